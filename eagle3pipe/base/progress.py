"""Progress: a tqdm bar (samples, tok/s, ETA) on a terminal; a plain log line every `every` seconds when
stderr is not a terminal (nohup logs read with `tail -f`). Either way, once the first batches have run (15 s, or 5 % of
the tokens), one line estimates the whole run from the rate measured so far."""
import logging
import sys
import time

log = logging.getLogger("eagle3")


def _fmt_eta(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt_minutes(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{max(1, round(seconds / 60))} min"


class Progress:
    def __init__(self, total, desc, unit="samples", every=30.0, initial=0, total_tokens=None):
        """`total_tokens` (when known) makes the ETA token-based: samples vary a lot in length."""
        self.total, self.desc, self.unit, self.every, self.total_tokens = total, desc, unit, every, total_tokens
        self.n = initial
        self.tokens = 0
        self.start = self.last = time.time()
        self.estimated, self.first = False, None
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit.rstrip("s"), dynamic_ncols=True)

    def rate(self):
        return self.tokens / max(time.time() - self.start, 1e-9)

    def update(self, n=1, tokens=0):
        self.n += n
        self.tokens += tokens
        if self.first is None or time.time() - self.first[0] < 0.5:
            # the rate is measured from the end of the first batch (which also warms up): its rows, which finish
            # within moments of each other, are not part of it
            self.first = (self.first or (time.time(),))[:1] + (self.tokens,)
        elif not self.estimated and self.total_tokens and (time.time() - self.first[0] >= 15 or (
                time.time() - self.first[0] >= 5 and self.tokens - self.first[1] >= 0.05 * self.total_tokens)):
            self.estimated = True
            self.estimate()
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

    def estimate(self):
        """One line: the rate of the first batches and what it means for the whole run."""
        t, tokens = self.first
        rate = (self.tokens - tokens) / max(time.time() - t, 1e-9)
        if rate <= 0:  # only failed rows so far: nothing to extrapolate from
            return
        left = (self.total_tokens - self.tokens) / rate
        finish = time.strftime("%H:%M", time.localtime(time.time() + left))
        msg = (f"{self.desc}: estimate at {rate:,.0f} tok/s (measured after the first batch): the remaining "
               f"{self.total_tokens - self.tokens:,} tokens take about {_fmt_minutes(left)} (done near {finish}; the "
               f"longest rows run first, so likely sooner)")
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info(msg)

    def close(self):
        if self.bar is not None:
            self.bar.close()
