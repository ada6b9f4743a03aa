"""Tests that need a CUDA GPU (marked cuda; they skip without one)."""
