"""Tests of hf_ppo.evaluation, one file per module."""
