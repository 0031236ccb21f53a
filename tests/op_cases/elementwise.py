from tests.op_cases import OpCase

CASES = [
    OpCase("Add", [(3, 4), (3, 4)]),
    OpCase("Add", [(2, 3, 4), (4,)], variant="bcast"),
]
