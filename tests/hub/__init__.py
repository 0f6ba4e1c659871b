"""Tests of hf_ppo.hub, one file per module."""
