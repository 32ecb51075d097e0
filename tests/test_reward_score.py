"""Rule-based scorers and the default scorer's dispatch on data_source."""

import multiprocessing
import threading

import pytest

from verl_megatron.utils.reward_score import (
    batch_default_compute_score,
    default_compute_score,
    gsm8k,
    known_data_sources,
    math_dapo,
    math_verify_score,
    synthetic,
)


@pytest.mark.parametrize(
    ("solution", "method", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "strict", "7"),
        ("#### 1,234 dollars", "strict", "1234"),
        ("#### -5 then #### 12", "strict", "12"),  # the last marked answer counts
        ("the answer is 7", "strict", None),  # strict also grades the format
        ("the answer is 7", "flexible", "7"),
        ("3 apples, then 1,200.", "flexible", "1200."),
        ("no digits here", "flexible", None),
    ],
)
def test_gsm8k_extraction(solution, method, expected):
    assert gsm8k.extract_solution(solution, method=method) == expected


def test_gsm8k_scores_and_format_score():
    assert gsm8k.compute_score("#### 72", "72") == 1.0
    assert gsm8k.compute_score("#### 71", "72") == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("72", "72") == 0.0  # no "####": no answer under strict
    assert gsm8k.compute_score("72", "72", method="flexible") == 1.0
    # Only the last 300 characters are searched.
    assert gsm8k.compute_score("#### 72" + " " * 300, "72") == 0.0
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible'"):
        gsm8k.extract_solution("#### 1", method="loose")


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),  # no box, no answer
        ("\\boxed{4", "4", 0.0),  # an unclosed box is no answer
    ],
)
def test_math_boxed_answers_are_checked_for_equivalence(solution, truth, expected):
    assert math_verify_score.compute_score(solution, truth) == expected


def test_last_boxed_content_handles_nested_braces():
    assert math_verify_score.last_boxed_content("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert math_verify_score.last_boxed_content("\\fbox{7}") == "7"
    assert math_verify_score.last_boxed_content("none") is None


def _score_in_thread(results):
    results.append(default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{\\frac{2}{4}}", "0.5"))


def _score_in_process(queue):
    queue.put(default_compute_score("lighteval/MATH", "\\boxed{10}", "10"))


def test_math_scorer_works_in_threads_and_worker_processes():
    # math-verify's own time limits use SIGALRM, which only a main thread may set.
    results = []
    thread = threading.Thread(target=_score_in_thread, args=(results,))
    thread.start()
    thread.join()
    assert results == [1.0]
    queue = multiprocessing.get_context("fork").Queue()
    process = multiprocessing.get_context("fork").Process(target=_score_in_process, args=(queue,))
    process.start()
    assert queue.get(timeout=60) == 1.0
    process.join(30)
    assert process.exitcode == 0


@pytest.mark.parametrize(
    ("solution", "truth", "score", "pred"),
    [
        ("reasoning...\nAnswer: 42", "42", 1.0, "42"),
        ("Answer: $1,000$ dollars", "1000", 1.0, "1000"),
        ("answer: x = \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
        ("Answer: 41\nwait\nAnswer: 42", "42", 1.0, "42"),
        ("Answer: 41", "42", -1.0, "41"),
        ("42", "42", -1.0, "[INVALID]"),
    ],
)
def test_dapo_answer_format_scores_plus_minus_one(solution, truth, score, pred):
    assert math_dapo.compute_score(solution, truth) == {"score": score, "acc": score == 1.0, "pred": pred}


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("120", "120", 1.0),
        ("1 2 0", "120", 1.0),  # a character tokenizer may decode with spaces
        ("1 2 0 7", "120", 0.75),  # an extra digit costs reward: 3 matches / 4
        ("12", "120", 2 / 3),
        ("021", "120", 1 / 3),
        ("no digits", "120", 0.0),
        ("5", 5, 1.0),  # an int ground truth is read as its digits
    ],
)
def test_synthetic_positional_digit_match(solution, truth, expected):
    assert synthetic.compute_score(solution, truth) == pytest.approx(expected, abs=0)


def test_synthetic_rejects_non_digit_ground_truth():
    with pytest.raises(ValueError, match="ground_truth must be a non-empty digit string, got '12a'"):
        synthetic.compute_score("12", "12a")


def test_default_scorer_dispatches_on_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("math_dapo", "Answer: 3", "3")["score"] == 1.0
    assert default_compute_score("aime2025", "Answer: 3", "4")["score"] == -1.0
    assert default_compute_score("synthetic/reverse", "3 2 1", "321") == 1.0
    assert default_compute_score("synthetic/copy", "1", "12", extra_info={"split": "train"}) == 0.5
    assert batch_default_compute_score(["openai/gsm8k", "synthetic/copy"], ["#### 3", "9"], ["3", "1"]) == [
        1.0,
        0.0,
    ]


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(NotImplementedError) as info:
        default_compute_score("my/dataset", "x", "y")
    message = str(info.value)
    assert "data_source='my/dataset'" in message
    for source in known_data_sources():
        assert source in message
    assert "aime*" in known_data_sources()
