"""The V-C reasoning system: Solver, Verifier and Corrector played by one policy (`system` holds the
loop and its rules).
"""
