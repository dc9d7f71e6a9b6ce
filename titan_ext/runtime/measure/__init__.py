"""What the ranks measure and exchange: per-action profiles, the window estimates, the metrics.
"""
