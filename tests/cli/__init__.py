"""Tests of hf_ppo.cli, one file per module."""
