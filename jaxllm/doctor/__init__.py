"""`jaxllm doctor`: what the environment is (facts.py), what is wrong with it (checks.py), the report and
the server's start-up summary line (report.py)."""

from jaxllm.doctor.checks import Finding, run_checks
from jaxllm.doctor.facts import EnvironmentFacts, gather_facts
from jaxllm.doctor.report import main, summary_line

__all__ = ["EnvironmentFacts", "Finding", "gather_facts", "main", "run_checks", "summary_line"]
