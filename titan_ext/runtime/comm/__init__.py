"""How ranks talk: the gloo control plane, bounded waits, the executor's transports and the delegate
data plane.
"""
