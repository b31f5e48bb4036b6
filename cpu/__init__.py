"""What a process of either side (a learner rank, a rollout worker) sets up when it runs on the CPU.

Both sides import it; it imports neither.
"""
