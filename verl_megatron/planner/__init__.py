"""``verl-megatron plan``: will a job fit, per GPU, before it is launched (see README "Will it fit?")."""
