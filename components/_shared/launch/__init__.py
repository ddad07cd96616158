"""How a stage runs: the stage command line, the run-and-record wrapper, launch plans, torchrun and
TrainJob launchers, the stage-result file. Imports `platform` (and the stage registry, lazily)."""
