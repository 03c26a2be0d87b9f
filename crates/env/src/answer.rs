//! Final answers of free-form replies: where a reply puts its answer (`\boxed{…}`, `#### …`, or
//! its last number), how a number is read (`1,234`, `$5`, `-3`, `3.50`), and how a reply's answer
//! is compared with a reference answer. Pure functions; the reward functions of
//! [`crate::reward_fns`] and the `qa` and `word_problems` tasks score with them.
//!
//! The rules (docs/envs.md has them with examples):
//! - **number**: ASCII digits, optionally grouped by thousands with commas (`1,234,567`: a comma
//!   counts only when exactly three digits follow it), optionally a decimal part (`3.50`); a `-`
//!   (or `−`, U+2212) right before it, not preceded by a letter or digit, makes it negative
//!   (`5-3` holds `5` and `3`); a `$` between sign and digits is allowed (`-$3`, `$-3`). A
//!   trailing `.` ends a sentence, not the number.
//! - **math answer** of a reply: the first number inside the last balanced `\boxed{…}`, else the
//!   first number after the last `####`, else the last number of the reply; none when the rule
//!   that applies finds no number (`\boxed{x}` has no numeric answer).
//! - **reference answer** of a dataset field: the text after its last `####` when it has one
//!   (GSM8K's `"…reasoning…\n#### 72"`), else the whole field; trimmed.
//! - **equal numbers**: `|a − b| ≤ 1e-6 · max(1, |a|, |b|)` (`3.5` = `3.50`, `72` = `72.0`).

use sluice_data::config::AnswerMarker;

/// `|a − b| ≤ NUMBER_TOLERANCE · max(1, |a|, |b|)` makes two numbers equal.
pub const NUMBER_TOLERANCE: f64 = 1e-6;

/// Whether `c` is a minus sign (ASCII `-` or the Unicode minus `−`).
fn is_minus(c: char) -> bool {
    c == '-' || c == '\u{2212}'
}

/// A number found in a text: its value and the char range it spans (sign and `$` included).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Found {
    value: f64,
    start: usize,
    end: usize,
}

/// Every number of `chars`, in order (see the module doc for what counts as one).
fn scan(chars: &[char]) -> Vec<Found> {
    let digit = |i: usize| chars.get(i).is_some_and(char::is_ascii_digit);
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !digit(i) {
            i += 1;
            continue;
        }
        // Sign and currency before the digits: `-3`, `-$3`, `$-3`, `$3`.
        let mut start = i;
        let mut negative = false;
        let mut back = i;
        if back > 0 && chars[back - 1] == '$' {
            back -= 1;
            start = back;
        }
        if back > 0
            && is_minus(chars[back - 1])
            && (back == 1 || !chars[back - 2].is_alphanumeric())
        {
            negative = true;
            start = back - 1;
            if start > 0 && chars[start - 1] == '$' {
                start -= 1;
            }
        }
        let mut text = String::new();
        let mut p = i;
        while digit(p) {
            text.push(chars[p]);
            p += 1;
        }
        // Thousands groups: a comma followed by exactly three digits.
        while chars.get(p) == Some(&',') && (1..=3).all(|k| digit(p + k)) && !digit(p + 4) {
            text.extend(&chars[p + 1..p + 4]);
            p += 4;
        }
        if chars.get(p) == Some(&'.') && digit(p + 1) {
            text.push('.');
            p += 1;
            while digit(p) {
                text.push(chars[p]);
                p += 1;
            }
        }
        if let Ok(v) = text.parse::<f64>() {
            out.push(Found {
                value: if negative { -v } else { v },
                start,
                end: p,
            });
        }
        i = p;
    }
    out
}

/// Every number in `text`, in order.
pub fn numbers(text: &str) -> Vec<f64> {
    let chars: Vec<char> = text.chars().collect();
    scan(&chars).into_iter().map(|f| f.value).collect()
}

/// LaTeX spellings inside `\boxed{}` that stand for plain characters: `\$`, `{,}` (a thousands
/// comma), `\%`, thin spaces.
fn plain_latex(text: &str) -> String {
    text.replace("\\$", "$")
        .replace("{,}", ",")
        .replace("\\%", "%")
        .replace("\\,", "")
        .replace("\\!", "")
}

/// `text` read as exactly one number (surrounding whitespace, a trailing `.` and LaTeX's `\$`
/// allowed): `"$1,234."` → 1234, `"-3"` → -3, `"3 apples"` → none.
pub fn parse_number(text: &str) -> Option<f64> {
    let text = plain_latex(text.trim());
    let text = text.strip_suffix('.').unwrap_or(&text).trim();
    let chars: Vec<char> = text.chars().collect();
    match scan(&chars).as_slice() {
        [one] if one.start == 0 && one.end == chars.len() => Some(one.value),
        _ => None,
    }
}

/// A JSON number as a reference answer's text: digits as written out, never in exponent form
/// (serde writes `1e-6`, whose last number the answer rules would read as 6).
pub fn number_text(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if !n.is_i64() && !n.is_u64() => format!("{f}"),
        _ => n.to_string(),
    }
}

/// Whether two numbers are equal within [`NUMBER_TOLERANCE`] (relative, absolute below 1).
pub fn numbers_equal(a: f64, b: f64) -> bool {
    (a - b).abs() <= NUMBER_TOLERANCE * a.abs().max(b.abs()).max(1.0)
}

/// The content of the last balanced `\boxed{…}` of `text` (nested braces kept:
/// `\boxed{\frac{1}{2}}` → `\frac{1}{2}`); an unclosed last one gives way to the one before.
pub fn last_boxed(text: &str) -> Option<&str> {
    const OPEN: &str = "\\boxed{";
    let mut end = text.len();
    while let Some(at) = text[..end].rfind(OPEN) {
        let body = &text[at + OPEN.len()..];
        let mut depth = 1usize;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(&body[..i]);
                    }
                }
                _ => {}
            }
        }
        end = at;
    }
    None
}

/// The text after the last `####` of `text`, up to the end of that line, trimmed (`None` when
/// there is no `####`).
pub fn after_last_hashes(text: &str) -> Option<&str> {
    let (_, rest) = text.rsplit_once("####")?;
    Some(rest.lines().next().unwrap_or("").trim())
}

/// The math answer of a reply (see the module doc): last `\boxed{}`'s first number, else the
/// first number after the last `####`, else the reply's last number.
pub fn math_answer(text: &str) -> Option<f64> {
    if let Some(boxed) = last_boxed(text) {
        return numbers(&plain_latex(boxed)).first().copied();
    }
    if let Some(after) = after_last_hashes(text) {
        return numbers(after).first().copied();
    }
    numbers(text).last().copied()
}

/// The reference answer of a dataset field: the text after its last `####`, else the whole
/// field, trimmed. `"Natalia sold 48/2 = 24 clips…\n#### 72"` → `"72"`.
pub fn reference_answer(field: &str) -> &str {
    match field.rsplit_once("####") {
        Some((_, after)) => after.trim(),
        None => field.trim(),
    }
}

/// The final answer of a reply as text: the last `\boxed{}`'s content, else the rest of the
/// line after the last `####`, else the whole reply; trimmed, inner whitespace runs made one
/// space.
pub fn final_answer_text(text: &str) -> String {
    let answer = last_boxed(text)
        .or_else(|| after_last_hashes(text))
        .unwrap_or(text);
    collapse_whitespace(answer)
}

/// `text` trimmed, with every run of whitespace made one space.
pub fn collapse_whitespace(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether `reply`'s math answer equals `reference`'s (a dataset field, see
/// [`reference_answer`]): as numbers when the reference has one; when it has none (`Paris`,
/// `x+1`), the reply's final answer text must equal it.
pub fn math_answer_matches(reply: &str, reference: &str) -> bool {
    let expected = reference_answer(reference);
    match parse_number(expected).or_else(|| math_answer(expected)) {
        Some(want) => math_answer(reply).is_some_and(|got| numbers_equal(got, want)),
        None => !expected.is_empty() && final_answer_text(reply) == collapse_whitespace(expected),
    }
}

/// Whether `answer` (a regex capture, an extracted answer) equals `reference` (a dataset field):
/// as numbers when both read as one number, else as trimmed text with whitespace runs made one.
pub fn answers_equal(answer: &str, reference: &str) -> bool {
    let expected = reference_answer(reference);
    match (parse_number(answer), parse_number(expected)) {
        (Some(a), Some(b)) => numbers_equal(a, b),
        _ => collapse_whitespace(answer) == collapse_whitespace(expected),
    }
}

/// Whether `reply` carries `marker` with an answer: `####` followed by a number (`#### 72`,
/// `#### $1,234`), or a `\boxed{…}` with something in it.
pub fn has_marker(reply: &str, marker: AnswerMarker) -> bool {
    match marker {
        AnswerMarker::Hashes => after_last_hashes(reply).is_some_and(|after| {
            let chars: Vec<char> = after.chars().collect();
            scan(&chars).first().is_some_and(|f| f.start == 0)
        }),
        AnswerMarker::Boxed => last_boxed(reply).is_some_and(|b| !b.trim().is_empty()),
    }
}

/// `answer` written with `marker`: `#### 72` or `\boxed{72}`.
pub fn with_marker(answer: &str, marker: AnswerMarker) -> String {
    match marker {
        AnswerMarker::Hashes => format!("#### {answer}"),
        AnswerMarker::Boxed => format!("\\boxed{{{answer}}}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_in_text() {
        assert_eq!(numbers("a 1,234 b -3 c 3.50."), [1234.0, -3.0, 3.5]);
        assert_eq!(numbers("5-3"), [5.0, 3.0]);
        assert_eq!(numbers("1,23 and 1,2345"), [1.0, 23.0, 1.0, 2345.0]);
        assert_eq!(numbers("(−7) costs -$4 or $-2"), [-7.0, -4.0, -2.0]);
        assert!(numbers("no digits here, ٧٢ ７２").is_empty());
    }

    #[test]
    fn boxed_is_balanced_and_last() {
        assert_eq!(
            last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}"),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(last_boxed(r"\boxed{4} and \boxed{5"), Some("4"));
        assert_eq!(last_boxed("none"), None);
    }
}
