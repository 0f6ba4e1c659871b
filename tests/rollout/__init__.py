"""Tests of hf_ppo.rollout, one file per module."""
