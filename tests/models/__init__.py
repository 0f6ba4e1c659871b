"""Tests of hf_ppo.models, one file per module."""
