"""Progress: a tqdm bar (samples, tok/s, ETA) on a terminal; a plain log line every `every` seconds when
stderr is not a terminal (nohup logs read with `tail -f`)."""
import logging
import sys
import time

log = logging.getLogger("eagle3")


def _fmt_eta(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total, desc, unit="samples", every=30.0, initial=0, total_tokens=None):
        """`total_tokens` (when known) makes the ETA token-based: samples vary a lot in length."""
        self.total, self.desc, self.unit, self.every, self.total_tokens = total, desc, unit, every, total_tokens
        self.n = initial
        self.tokens = 0
        self.start = self.last = time.time()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit.rstrip("s"), dynamic_ncols=True)

    def rate(self):
        return self.tokens / max(time.time() - self.start, 1e-9)

    def update(self, n=1, tokens=0):
        self.n += n
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(f"{self.rate():,.0f} tok/s", refresh=False)
        elif time.time() - self.last >= self.every or self.n >= self.total:
            self.last = time.time()
            self.line()

    def line(self):
        elapsed = time.time() - self.start
        if self.total_tokens and self.tokens:
            eta = (self.total_tokens - self.tokens) / self.rate()
        else:
            eta = elapsed / max(self.n, 1e-9) * (self.total - self.n) if self.n else 0
        pct = 100.0 * self.n / max(self.total, 1)
        log.info(f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct:.1f}%) {self.rate():,.0f} tok/s "
                 f"elapsed {_fmt_eta(elapsed)} ETA {_fmt_eta(eta)}")

    def close(self):
        if self.bar is not None:
            self.bar.close()
