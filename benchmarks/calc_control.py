"""The control of the calculator task (benchmarks/llm_learning.py --configs calc): a tool with the built-in
calculator's name and description whose every call fails, so that the policy sees only error results."""


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, as 37*85
    """
    raise RuntimeError("the calculator is out of order")
