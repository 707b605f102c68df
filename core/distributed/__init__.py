"""Distributed helpers: differentiable collectives, gradient sync, grad norm and clipping."""
