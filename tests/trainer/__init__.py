"""Tests of hf_ppo.trainer, one file per module."""
