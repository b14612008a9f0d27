"""Pure RL math over tensors: no Ray, no Megatron, no config objects.

Modules: advantages, losses, rollout_is, correction (rollout IS + rejection + bypass composed),
filtering, kl, adca. Each maps config names to functions with
a plain dict; ``"pkg.module:function"`` plugs in a user's own (see ``utils.load_fn``).
"""
