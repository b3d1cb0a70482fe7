"""GPU readings: nvidia-smi status (smi), the machine preflight (doctor), the live status
refresher (watch), and the memory estimate (fit)."""

from .smi import (GpuStatus, Gpu, GpuProcess, StatusKind, Unknown, known, query_status,
                  sections_command, split_sections, status_sections)
from .doctor import Check, DoctorReport, Level, diagnose, doctor_sections, failure_hint, run_doctor
from .watch import Watcher

__all__ = ['GpuStatus', 'Gpu', 'GpuProcess', 'StatusKind', 'Unknown', 'known', 'query_status',
           'sections_command', 'split_sections', 'status_sections',
           'Check', 'DoctorReport', 'Level', 'diagnose', 'doctor_sections', 'failure_hint',
           'run_doctor', 'Watcher']
