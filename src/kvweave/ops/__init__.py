"""Shared numerical building blocks of every method: masks, attention over parts, integer storage, RoPE
and low-rank factorization. Methods import from here; nothing here knows about a method."""
