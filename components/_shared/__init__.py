"""Plumbing shared by the stages: config base, storage, tracking, CLI helpers. Imports no stage."""
