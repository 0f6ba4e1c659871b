"""Tests of hf_ppo.rewards, one file per module."""
