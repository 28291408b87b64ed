"""nccl-tests' bandwidth conventions, the alpha-beta model, the printed table and the plots.

algbw = S / t, with S the collective's data size (the whole buffer). busbw = algbw * factor, the
factor making busbw comparable with the link's peak for an optimal algorithm (nccl-tests,
doc/PERFORMANCE.md): all-reduce 2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n;
broadcast and reduce 1. The alpha-beta (Hockney) model t(S) = alpha + beta * S is fitted by least
squares for each (collective, implementation, world size) over the sizes measured in the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def bus_factor(collective: str, n: int) -> float:
    if n <= 1:
        return 1.0 if collective in ("broadcast", "reduce") else 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Measurement:
    collective: str
    impl: str
    world_size: int
    size_bytes: int
    seconds: float  # max over ranks of the per-call time

    @property
    def algbw(self) -> float:  # GB/s
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.collective, self.world_size)


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares alpha (s) and beta (s/byte) of t = alpha + beta * S; None with < 2 sizes."""
    if len({s for s, _ in points}) < 2:
        return None
    count = len(points)
    mean_s = sum(s for s, _ in points) / count
    mean_t = sum(t for _, t in points) / count
    var = sum((s - mean_s) ** 2 for s, _ in points)
    beta = sum((s - mean_s) * (t - mean_t) for s, t in points) / var
    return mean_t - beta * mean_s, beta


def table(measurements: list[Measurement], native: str) -> str:
    """nccl-tests-like rows: size, time, algbw, busbw, the model's prediction, ratio to native."""
    models = {}
    for key in {(m.collective, m.impl, m.world_size) for m in measurements}:
        models[key] = fit_alpha_beta([(m.size_bytes, m.seconds) for m in measurements if (m.collective, m.impl, m.world_size) == key])
    by_key = {(m.collective, m.world_size, m.size_bytes, m.impl): m for m in measurements}
    lines = [
        f"{'collective':<24}{'n':>3}{'impl':>20}{'size':>12}{'time(us)':>12}{'model(us)':>11}"
        f"{'algbw GB/s':>12}{'busbw GB/s':>12}{'vs native':>10}"
    ]
    for m in sorted(measurements, key=lambda m: (m.collective, m.world_size, m.size_bytes, m.impl)):
        model = models[(m.collective, m.impl, m.world_size)]
        predicted = f"{(model[0] + model[1] * m.size_bytes) * 1e6:11.0f}" if model else f"{'-':>11}"
        reference = by_key.get((m.collective, m.world_size, m.size_bytes, native))
        ratio = f"{reference.seconds / m.seconds:10.2f}" if reference and m.impl != native else f"{'':>10}"
        lines.append(
            f"{m.collective:<24}{m.world_size:>3}{m.impl:>20}{_size(m.size_bytes):>12}{m.seconds * 1e6:12.0f}"
            f"{predicted}{m.algbw:12.3f}{m.busbw:12.3f}{ratio}"
        )
    lines.append("")
    lines.append("alpha-beta fits (t = alpha + beta*S):")
    for (collective, impl, n), model in sorted(models.items()):
        if model:
            alpha, beta = model
            bandwidth = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "n/a"
            lines.append(f"  {collective:<24} n={n} {impl:<20} alpha={alpha * 1e6:8.1f} us  1/beta={bandwidth}")
    return "\n".join(lines)


def _size(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:g} {unit}"
        size /= 1024
    return str(size)


def plot(measurements: list[Measurement], out_dir: Path) -> list[Path]:
    """busbw against size per world size (one PNG per collective), and time against world size at
    the largest size with the fitted model's curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for collective in sorted({m.collective for m in measurements}):
        rows = [m for m in measurements if m.collective == collective]
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        for impl in sorted({m.impl for m in rows}):
            for n in sorted({m.world_size for m in rows if m.world_size > 1}):
                series = sorted((m.size_bytes, m.busbw) for m in rows if m.impl == impl and m.world_size == n)
                left.plot([s for s, _ in series], [b for _, b in series], marker="o", label=f"{impl} n={n}")
        left.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title=f"{collective}: busbw")
        left.legend(fontsize=7)
        largest = max(m.size_bytes for m in rows)
        for impl in sorted({m.impl for m in rows}):
            series = sorted((m.world_size, m.seconds) for m in rows if m.impl == impl and m.size_bytes == largest)
            right.plot([n for n, _ in series], [t * 1e3 for _, t in series], marker="o", label=f"{impl} measured")
            predicted = []
            for n, _ in series:
                model = fit_alpha_beta([(m.size_bytes, m.seconds) for m in rows if m.impl == impl and m.world_size == n])
                predicted.append((n, (model[0] + model[1] * largest) * 1e3 if model else float("nan")))
            right.plot([n for n, _ in predicted], [t for _, t in predicted], linestyle="--", label=f"{impl} alpha-beta")
        right.set(xlabel="world size", ylabel="time (ms)", title=f"{collective}: time at {_size(largest)}")
        right.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{collective}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
