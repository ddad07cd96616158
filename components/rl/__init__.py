"""rl: PPO (actor + value head), TER (task-efficacy REINFORCE) or GRPO on the SFT policy, with reward-hacking gates."""
