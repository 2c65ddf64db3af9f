"""Reading a traced program: every equation of a jaxpr, the ones of the programs nested in it included."""


def walk(jaxpr):
    """Every equation of `jaxpr`, and of the programs nested in it (loops, calls), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from walk(inner)
