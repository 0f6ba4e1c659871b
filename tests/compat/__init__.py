"""Tests of hf_ppo.compat, one file per module."""
