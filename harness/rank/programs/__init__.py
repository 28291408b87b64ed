"""Rank programs: the rank-side half of each test. A program takes (context, impl, **inputs),
calls the implementation under test, and returns what it produced. Programs never judge."""
