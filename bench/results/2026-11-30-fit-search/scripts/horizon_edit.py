"""Scratch (not kept): the `horizon` constant tried in the fitted family on 2026-11-30. Run from the repository
root on code 4938e4c to apply it: the score's per-token chance of a next use becomes 1 / E[T], where the
sequence ends after about `horizon` tokens and the next one uses the key with the collection's chance."""

from pathlib import Path

p = Path("moeinf/policy/kernels.py")
s = p.read_text()
s = s.replace(
    "P_SPAN, P_TOPK, P_CARRY, P_SLOW, P_MIX, P_FIRST = 8, 9, 10, 11, 12, 13",
    "P_SPAN, P_TOPK, P_CARRY, P_SLOW, P_MIX, P_FIRST, P_HORIZON = 8, 9, 10, 11, 12, 13, 14",
)
s = s.replace("NUM_PARAMS = 14", "NUM_PARAMS = 15")
s = s.replace("terms = np.zeros((5, num_layers))", "terms = np.zeros((6, num_layers))")
s = s.replace(
    """        terms[2, layer] = mix
        layered""",
    """        terms[2, layer] = mix
        terms[5, layer] = params[P_TOPK] / seen_total[layer] if seen_total[layer] > 0.0 else 0.0
        layered""",
)
s = s.replace(
    """    span, topk = params[P_SPAN] * num_layers, params[P_TOPK]
""",
    """    span, topk, horizon = params[P_SPAN] * num_layers, params[P_TOPK], params[P_HORIZON]
""",
)
s = s.replace(
    """terms[3, key_layer], terms[4, key_layer], span, topk)""",
    """terms[3, key_layer], terms[4, key_layer], span, topk,
                           terms[5, key_layer], horizon)""",
)
s = s.replace(
    """                                   terms[4, key_layer], span, topk)""",
    """                                   terms[4, key_layer], span, topk, terms[5, key_layer], horizon)""",
)
s = s.replace(
    """           weight: float, slow_scale: float, span: float, topk: float) -> float:""",
    """           weight: float, slow_scale: float, span: float, topk: float, next_scale: float,
           horizon: float) -> float:""",
)
s = s.replace(
    """    share = recent * inv_total + count * prior_scale + follow * follow_scale + slow * slow_scale + eps
""",
    """    share = recent * inv_total + count * prior_scale + follow * follow_scale + slow * slow_scale + eps
    if horizon > 0.0:
        chance = min(1.0, topk * share)
        later = min(1.0, count * next_scale + topk * eps)
        stay = np.exp(-chance * horizon)
        share = 1.0 / (topk * ((1.0 - stay) / chance + stay / later))
""",
)
p.write_text(s)
p = Path("moeinf/policy/fitted.py")
s = p.read_text()
s = s.replace(
    """    first_use: float = 0.0

    def apply""",
    """    first_use: float = 0.0
    horizon: float = 0.0

    def apply""",
)
s = s.replace(
    """        params[kernels.P_FIRST] = self.first_use
""",
    """        params[kernels.P_FIRST] = self.first_use
        params[kernels.P_HORIZON] = self.horizon
""",
)
p.write_text(s)
