"""GPU readings: nvidia-smi queries and parsers, doctor checks."""

from .smi import query_status, run_doctor, split_sections, doctor_commands, sections_script

__all__ = ['query_status', 'run_doctor', 'split_sections', 'doctor_commands', 'sections_script']
