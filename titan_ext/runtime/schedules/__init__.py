"""The adaptive schedules, one registry entry each, beside each other.
"""
