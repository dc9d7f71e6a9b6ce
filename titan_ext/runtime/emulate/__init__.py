"""Straggler emulation on the real PP messages (per-link latency and bandwidth).
"""
