//! Reading tool-call bodies (`{"name": …, "arguments": {…}}`) as they are generated: the header
//! once the name is complete, and the arguments object as the model wrote it minus whitespace.

/// The start of a tool-call body: its name, once complete, and where the value of `arguments`
/// starts, when the body reads `{"name": "…", "arguments": …` (a body in another order is
/// announced when it closes).
pub(crate) struct Header {
    /// The function name.
    pub name: String,
    /// Where the `arguments` object starts, when it follows the name.
    pub args_at: Option<usize>,
}

/// The header of `body`, a tool-call body so far (`None` until the name is complete).
pub(crate) fn scan_header(body: &str) -> Option<Header> {
    let mut at = skip_ws(body, 0);
    at = expect(body, at, "{")?;
    at = skip_ws(body, at);
    let (key, next) = json_string(body, at)?;
    if key != "name" {
        return None;
    }
    at = expect(body, skip_ws(body, next), ":")?;
    let (name, next) = json_string(body, skip_ws(body, at))?;
    if name.is_empty() {
        return None;
    }
    let args_at = (|| {
        let at = expect(body, skip_ws(body, next), ",")?;
        let (key, next) = json_string(body, skip_ws(body, at))?;
        (key == "arguments").then_some(())?;
        let at = expect(body, skip_ws(body, next), ":")?;
        Some(skip_ws(body, at))
    })();
    Some(Header { name, args_at })
}

fn skip_ws(s: &str, at: usize) -> usize {
    at + s[at..].len() - s[at..].trim_start().len()
}

fn expect(s: &str, at: usize, token: &str) -> Option<usize> {
    s[at..].starts_with(token).then_some(at + token.len())
}

/// A complete JSON string literal at `at`: its value and the position after it.
fn json_string(s: &str, at: usize) -> Option<(String, usize)> {
    let rest = s[at..].strip_prefix('"')?;
    let mut escaped = false;
    for (i, c) in rest.char_indices() {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, '\\') => escaped = true,
            (false, '"') => {
                let end = at + 1 + i + 1;
                let value = serde_json::from_str::<String>(&s[at..end]).ok()?;
                return Some((value, end));
            }
            _ => {}
        }
    }
    None
}

/// A JSON value starting at `raw`'s first character, with whitespace outside strings dropped and
/// everything else copied as written (key order, escapes, numbers): as much of it as `raw`
/// holds, and where it ends in `raw` once complete. Any prefix of a value maps to a prefix of
/// its whole form.
pub(crate) fn minify_prefix(raw: &str) -> (String, Option<usize>) {
    let mut out = String::new();
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, c) in raw.char_indices() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                if depth == 0 {
                    return (out, Some(i + 1));
                }
            }
            continue;
        }
        match c {
            c if c.is_whitespace() => {}
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                depth += 1;
                out.push(c);
            }
            // The end of a scalar.
            '}' | ']' | ',' if depth == 0 => return (out, Some(i)),
            '}' | ']' => {
                depth -= 1;
                out.push(c);
                if depth == 0 {
                    return (out, Some(i + 1));
                }
            }
            _ => out.push(c),
        }
    }
    (out, None)
}

/// The `arguments` (else `parameters`) object of a tool-call body as the model wrote it, minus
/// whitespace (`None` when it is not an object: the parser's value stands). The last of
/// duplicate keys wins, as in serde_json.
pub(crate) fn raw_arguments(body: &str) -> Option<String> {
    let mut at = expect(body, skip_ws(body, 0), "{")?;
    let (mut arguments, mut parameters) = (None, None);
    loop {
        at = skip_ws(body, at);
        if body[at..].starts_with('}') {
            break;
        }
        let (key, next) = json_string(body, at)?;
        at = skip_ws(body, expect(body, skip_ws(body, next), ":")?);
        let (value, end) = minify_prefix(&body[at..]);
        at += end?;
        match key.as_str() {
            "arguments" => arguments = Some(value),
            "parameters" => parameters = Some(value),
            _ => {}
        }
        at = skip_ws(body, at);
        match body[at..].chars().next()? {
            ',' => at += 1,
            '}' => break,
            _ => return None,
        }
    }
    arguments.or(parameters).filter(|v| v.starts_with('{'))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn arguments_keep_the_models_text_without_whitespace() {
        assert_eq!(
            minify_prefix(r#"{ "a": "x y", "b": [1, -2"#),
            (r#"{"a":"x y","b":[1,-2"#.into(), None)
        );
        assert_eq!(
            minify_prefix(r#"{"a": {"c": true}} trailing"#),
            (r#"{"a":{"c":true}}"#.into(), Some(18))
        );
        assert_eq!(
            minify_prefix(r#"{"a": "}\" "}, x"#),
            (r#"{"a":"}\" "}"#.into(), Some(13))
        );
        assert_eq!(minify_prefix("12 , x"), ("12".into(), Some(3)));
        let body =
            r#" {"name": "f", "parameters": {"q": 1}, "arguments": {"z": 2.50, "b": "\u0041"} } "#;
        assert_eq!(
            raw_arguments(body).as_deref(),
            Some(r#"{"z":2.50,"b":"\u0041"}"#)
        );
        assert_eq!(
            raw_arguments(r#"{"name": "f", "parameters": {"q": 1}}"#).as_deref(),
            Some(r#"{"q":1}"#)
        );
        assert_eq!(raw_arguments(r#"{"name": "f", "arguments": "{}"}"#), None);
        assert_eq!(raw_arguments(r#"{"name": "f"}"#), None);
        // The text is valid JSON with the same meaning as what the parser read.
        let v: Value = serde_json::from_str(&raw_arguments(body).unwrap()).unwrap();
        assert_eq!(v, json!({"b": "A", "z": 2.5}));
    }
}
