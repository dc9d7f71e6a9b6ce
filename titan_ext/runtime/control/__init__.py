"""How an adaptive schedule is put together and driven: its registry entry and parts, its config, the
extensions and observers it calls, the check cadence, and a plan's way from candidate to swap.
"""
