"""What the model costs, from its shapes: parameters, FLOPs, activation bytes kept for backward
(and their measurement), for pipeline balance, the planner and MFU."""
