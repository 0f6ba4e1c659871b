"""Tests of hf_ppo.algorithms, one file per module."""
