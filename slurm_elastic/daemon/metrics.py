"""Prometheus text-format metrics on a local HTTP port (``GET /metrics``), from a daemon thread."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Metrics:
    """Counters and gauges with labels; rendered in the Prometheus text exposition format 0.0.4."""

    HELP = {
        "slurm_elastic_jobs": ("gauge", "Elastic jobs by state in the last cycle."),
        "slurm_elastic_gpus_allocated": ("gauge", "GPUs held by running elastic jobs."),
        "slurm_elastic_gpus_available": ("gauge", "GPUs available to elastic jobs (managed nodes minus non-elastic jobs)."),
        "slurm_elastic_rescales_total": ("counter", "Resizes carried out, by direction."),
        "slurm_elastic_actions_total": ("counter", "Actions by kind and outcome."),
        "slurm_elastic_cycle_seconds": ("gauge", "Duration of the last scheduling cycle."),
        "slurm_elastic_solve_seconds": ("gauge", "Optimizer time in the last cycle."),
        "slurm_elastic_cycles_total": ("counter", "Scheduling cycles run."),
        "slurm_elastic_errors_total": ("counter", "Errors by kind (slurm, parse, spec, action)."),
        "slurm_elastic_cycles_skipped_total": ("counter", "Cycles that acted on nothing, by reason (slurm: Slurm "
                                               "unreadable, parse: garbled answer, second_daemon: another holds the lease)."),
        "slurm_elastic_last_cycle_timestamp_seconds": ("gauge", "Unix time the last full cycle ended (alert when old)."),
        "slurm_elastic_job_gpus": ("gauge", "GPUs of each elastic job (running, starting or being resized), by "
                                   "job_id (not job: Prometheus' own target label), user and status."),
        "slurm_elastic_job_batch": ("gauge", "Global batch size of each running elastic job, by job_id."),
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = float(value)

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def get(self, name: str, **labels) -> float:
        return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def clear(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._values if k[0] == name]:
                del self._values[key]

    def render(self) -> str:
        lines = []
        with self._lock:
            items = sorted(self._values.items())
        seen = set()
        for (name, labels), value in items:
            if name not in seen:
                kind, help_ = self.HELP.get(name, ("gauge", name))
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                seen.add(name)
            lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels)
            lines.append(f"{name}{{{lab}}} {value:g}" if lab else f"{name} {value:g}")
        return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    """A label value in the text format: \\, \" and \n escaped (the only escapes it has), any other
    control character replaced, so a value from a user cannot break the exposition."""
    v = v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "".join(c if c.isprintable() or c == " " else "\ufffd" for c in v)


def metric_names(text: str) -> set[str]:
    """The metric names a rendering (the Prometheus text format) carries."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


class MetricsServer:
    """Serves ``metrics.render()`` at /metrics; binds 127.0.0.1 unless configured otherwise."""

    def __init__(self, metrics: Metrics, address: str = "127.0.0.1", port: int = 9788):
        m = metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = m.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.address = self.server.server_address
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
