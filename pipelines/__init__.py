"""The KFP pipeline, its presets, the Kubernetes helpers and the `qvl` command line."""
