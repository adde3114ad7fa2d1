"""Compiler: one model step's jaxpr to an eligibility-trace graph."""

from braintrace._compiler._compile import compile_graph as compile_graph
from braintrace._compiler._graph import ETraceGraph as ETraceGraph
from braintrace._compiler._graph import Exclusion as Exclusion
from braintrace._compiler._graph import HiddenGroup as HiddenGroup
from braintrace._compiler._graph import Relation as Relation

__all__ = ["ETraceGraph", "Exclusion", "HiddenGroup", "Relation", "compile_graph"]
