"""verl's per-sample reward loop (``verl.experimental.reward_loop``): only its reward managers."""
