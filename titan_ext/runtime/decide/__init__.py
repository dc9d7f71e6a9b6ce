"""What the policy decides and the planners it calls at run time: re-plan or keep (Eq.1), the
regime, the backward variant, the memory budget, several stages per rank.
"""
