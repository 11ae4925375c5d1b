"""Offline data preparation: chat-template tokenization into Megatron indexed datasets,
the demo tokenizer and data set, text-to-instruction tasks, and mixture reports."""
