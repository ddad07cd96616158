"""Preflight: validate every stage config and reach the lake, MLflow and the models before any GPU is requested."""
