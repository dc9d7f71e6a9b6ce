"""Running one rank's action list: the instrumented loop, the device layer (timing, arrivals, waits),
activation memory, losses by micro-batch.
"""
