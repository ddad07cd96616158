"""reward_model: a Qwen-VL backbone with a scalar head, trained on preference pairs with the Bradley-Terry loss."""
