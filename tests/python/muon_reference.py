"""The float64 Newton–Schulz of DESIGN section 2.1 that the Python tests compare dmuon against."""

KELLER = (3.4445, -4.7750, 2.0315)


def newton_schulz_ref(u, steps=5):
    """Keller's quintic on the transposed-if-tall matrix u (rows, cols), normalised by its Frobenius
    norm + 1e-7, in float64."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = KELLER
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x
