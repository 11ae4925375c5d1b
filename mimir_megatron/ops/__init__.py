"""Operations: browsing runs in MLflow (`mimir ui`) and a local MLflow server for tests."""
