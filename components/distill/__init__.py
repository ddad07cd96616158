"""distill: knowledge distillation of the RL policy into a smaller student (pruned, random or given init)."""
