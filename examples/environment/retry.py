"""An environment of one's own: the model answers a word problem; a wrong answer is told so and the
model tries again, for at most rollout.environment.max_turns turns. Each wrong answer, the last one
included, costs `penalty` (a per-turn reward, summed and added to the episode's outcome reward)."""

import re

from rollout.environment import Environment, StepResult

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Retry(Environment):
    def __init__(self, penalty=0.1, feedback="That is not right. Check your work and try again."):
        super().__init__()
        self.penalty, self.feedback = penalty, feedback
        self.answer = None

    def reset(self, problem):
        self.answer = problem.ground_truth      # the row's answer; problem.metadata holds its other columns
        return None                             # None: open with the problem's own messages

    def step(self, response):
        numbers = NUMBER.findall(response)
        if numbers and self.answer is not None and float(numbers[-1]) == float(self.answer):
            return StepResult(done=True)        # right: the episode ends, its last turn is scored
        return StepResult(messages=[{"role": "user", "content": self.feedback}], reward=-self.penalty)
