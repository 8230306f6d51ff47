"""Two runs that should train alike, compared after AdamW steps, by what AdamW guarantees on any
processor and BLAS (the same rule as tests/support/after_adamw.h, where it is derived).

Their gradients agree to rounding; compare those tightly before any step. AdamW then divides each
gradient by its own running RMS, so an element whose gradient is near eps (or zero in exact
arithmetic, as the key third of c_attn.bias) turns a rounding difference into a step difference of
a sizeable fraction of lr. After the steps, each tensor as a whole agrees (||a - b|| a small
fraction of the update the steps make, about lr per element and step, so lr * steps * sqrt(n);
the weights' own size is not the scale of what rounding moves), and no element differs by more
than 2 lr sum_t R_t, R_t = sqrt(sum_i w_i^2 / u_i) over
Adam's bias-corrected moment weights (Cauchy-Schwarz: |m_t| <= R_t sqrt(v_t) whatever the
gradients; R_1 = 1)."""
import math


def adam_update_bound(t, beta1=0.9, beta2=0.999):
    c1, c2 = 1 - beta1 ** t, 1 - beta2 ** t
    return math.sqrt(sum(((1 - beta1) * beta1 ** (t - i) / c1) ** 2 / ((1 - beta2) * beta2 ** (t - i) / c2)
                         for i in range(1, t + 1)))


def adamw_drift_bound(lr, steps, beta1=0.9, beta2=0.999):
    return sum(2 * lr * adam_update_bound(t, beta1, beta2) for t in range(1, steps + 1))


def gradient_problems(actual, expected, tolerance=1e-5, floor=1e-10):
    """Names of the gradients of `expected` that `actual` misses or whose largest difference is
    above `tolerance` of the tensor's largest element (plus `floor`), with the figures."""
    problems = []
    for name, g in expected.items():
        if name not in actual:
            problems.append(f"{name}: missing")
            continue
        worst = float((actual[name].double() - g.double()).abs().max())
        scale = float(g.abs().max())
        if worst > tolerance * scale + floor:
            problems.append(f"{name}: largest difference {worst:.3g} against {tolerance:g} of {scale:.3g}")
    return problems


def tensor_problem(actual, expected, lr, steps, update_fraction):
    """Why one tensor disagrees after `steps` AdamW steps of `lr`, or None. update_fraction None:
    the element-wise bound alone."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} against {tuple(expected.shape)}"
    difference = actual.double() - expected.double()
    bound = adamw_drift_bound(lr, steps)
    worst = float(difference.abs().max())
    whole = float(difference.norm())
    update = lr * steps * math.sqrt(expected.numel())
    why = []
    if worst > bound:
        why.append(f"an element differs by {worst:.3g}, more than {steps} AdamW steps of lr {lr:g} can move it "
                   f"({bound:.3g})")
    if update_fraction is not None and whole > update_fraction * update:
        why.append(f"||a - b|| = {whole:.3g} is {whole / update:.3g} of the update lr * steps * sqrt(n) = "
                   f"{update:.3g} (at most {update_fraction:g})")
    return "; ".join(why) or None


def weight_problems(actual, expected, lr, steps, update_fraction=1e-3):
    """Every weight of `expected` against `actual`'s. The key third of each c_attn.bias (a zero
    gradient in exact arithmetic: softmax ignores what it adds to a query's scores) holds
    AdamW-scaled rounding noise that differs between runs: it is held to the element-wise bound
    only; its query and value thirds compare as any weight. The thirds are read off the bias's
    own length (3 n_embd), whatever the model."""
    import torch
    problems = [f"{name}: missing" for name in expected if name not in actual]
    problems += [f"{name}: not expected" for name in actual if name not in expected]
    for name, w in expected.items():
        if name not in actual:
            continue
        a = actual[name]
        checks = [(name, a, w, update_fraction)]
        if name.endswith("attn.c_attn.bias") and w.dim() == 1 and w.shape[0] % 3 == 0:
            C = w.shape[0] // 3
            checks = [(name + " key third", a[C:2 * C], w[C:2 * C], None),
                      (name + " query and value thirds", torch.cat([a[:C], a[2 * C:]]), torch.cat([w[:C], w[2 * C:]]),
                       update_fraction)]
        for label, x, y, rel in checks:
            problem = tensor_problem(x, y, lr, steps, rel)
            if problem:
                problems.append(f"{label}: {problem}")
    return problems
