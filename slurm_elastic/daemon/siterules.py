"""What a site allows a spec, beyond its syntax: the weight maximum, where ``ckpt_dir`` may point, and a
``pace`` that names a known profile (else the job would fail at its start; pace is checked, never used).

Checked by the daemon for every elastic job each cycle (the spec parser, shared with the plugin, already
refuses relative paths and system directories). A violation is that job's bad spec: it names the job and
the field, the job is never acted on, and the cycle goes on for the others.
"""

from __future__ import annotations

import os

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.daemon.userfiles import UserFileError, open_dir
from slurm_elastic.spec import ElasticSpec, SpecError, system_dir_of


class SiteRules:
    def __init__(self, max_weight: float, state_dir: str):
        self.max_weight = max_weight
        self.state_dir = os.path.realpath(state_dir)

    def check(self, job: JobRecord, spec: ElasticSpec) -> None:
        if spec.weight > self.max_weight:
            raise SpecError(f"weight {spec.weight:g} exceeds the site maximum {self.max_weight:g} (max_weight)",
                            job_id=job.job_id, field="weight")
        if spec.pace:
            from slurm_elastic.profiles import load_profile

            try:
                load_profile(spec.pace)
            except KeyError as e:
                raise SpecError(str(e.args[0]), job_id=job.job_id, field="pace") from None
        d = spec.checkpoint_dir(job.job_id, job.work_dir)
        if not d:
            return
        field = "ckpt_dir" if spec.ckpt_dir else "ckpt_dir (default: work dir)"
        sysdir = system_dir_of(d)
        if sysdir:
            raise SpecError(f"{d!r} is a system directory ({sysdir})", job_id=job.job_id, field=field)
        if d.rstrip("/") == self.state_dir or d.startswith(self.state_dir.rstrip("/") + "/"):
            raise SpecError(f"{d!r} is in the daemon's state directory", job_id=job.job_id, field=field)
        try:
            fd = open_dir(d, job.user_id)
        except FileNotFoundError:
            return  # not made yet: nothing to read; checked again once it exists
        except UserFileError as e:
            raise SpecError(f"{e.reason} ({d})", job_id=job.job_id, field=field) from None
        except OSError as e:
            raise SpecError(f"cannot open {d}: {e.strerror}", job_id=job.job_id, field=field) from None
        os.close(fd)
