"""Tests of hf_ppo.runtime, one file per module."""
