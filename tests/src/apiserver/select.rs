//! `fieldSelector` and `labelSelector` as the API server evaluates them (the common subset:
//! `=`, `==`, `!=` for fields; those plus `in`, `notin`, `key` and `!key` for labels).
use serde_json::Value;

/// A parsed selector pair; the empty selector matches everything.
#[derive(Debug, Default)]
pub struct Selector {
    fields: Vec<(String, bool, String)>,
    labels: Vec<LabelReq>,
}

#[derive(Debug)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Absent(String),
}

impl Selector {
    pub fn parse(fields: Option<&str>, labels: Option<&str>) -> Result<Selector, String> {
        let mut sel = Selector::default();
        for req in fields.into_iter().flat_map(|s| s.split(',')).filter(|r| !r.trim().is_empty()) {
            let (path, eq, value) = if let Some((k, v)) = req.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
                (k, true, v)
            } else {
                return Err(format!("invalid field selector requirement {req:?}"));
            };
            sel.fields.push((path.trim().into(), eq, value.trim().into()));
        }
        for req in split_outside_parens(labels.unwrap_or_default()) {
            sel.labels.push(parse_label_req(req.trim())?);
        }
        Ok(sel)
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let fields_ok = self.fields.iter().all(|(path, eq, want)| {
            let pointer = format!("/{}", path.replace('.', "/"));
            let have = match obj.pointer(&pointer) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (have == *want) == *eq
        });
        let labels = obj.pointer("/metadata/labels");
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        fields_ok
            && self.labels.iter().all(|req| match req {
                LabelReq::Eq(k, v) => label(k) == Some(v),
                LabelReq::Ne(k, v) => label(k) != Some(v),
                LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
                LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
                LabelReq::Exists(k) => label(k).is_some(),
                LabelReq::Absent(k) => label(k).is_none(),
            })
    }
}

fn split_outside_parens(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

fn parse_label_req(req: &str) -> Result<LabelReq, String> {
    let set = |key: &str, rest: &str| -> Result<(String, Vec<String>), String> {
        let inner = rest.trim().strip_prefix('(').and_then(|r| r.strip_suffix(')')).ok_or_else(|| format!("invalid label selector requirement {req:?}"))?;
        Ok((key.trim().into(), inner.split(',').map(|v| v.trim().to_string()).collect()))
    };
    Ok(if let Some((k, v)) = req.split_once("!=") {
        LabelReq::Ne(k.trim().into(), v.trim().into())
    } else if let Some((k, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
        LabelReq::Eq(k.trim().into(), v.trim().into())
    } else if let Some((k, rest)) = req.split_once(" notin ") {
        let (k, vs) = set(k, rest)?;
        LabelReq::NotIn(k, vs)
    } else if let Some((k, rest)) = req.split_once(" in ") {
        let (k, vs) = set(k, rest)?;
        LabelReq::In(k, vs)
    } else if let Some(k) = req.strip_prefix('!') {
        LabelReq::Absent(k.trim().into())
    } else {
        LabelReq::Exists(req.into())
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn selects() {
        let obj = json!({"metadata": {"name": "n1", "labels": {"app": "web", "tier": "fe"}}});
        let yes = |f: Option<&str>, l: Option<&str>| Selector::parse(f, l).unwrap().matches(&obj);
        assert!(yes(Some("metadata.name=n1"), None));
        assert!(!yes(Some("metadata.name=n2"), None));
        assert!(yes(Some("metadata.name!=n2,metadata.namespace="), None));
        assert!(yes(None, Some("app=web,tier in (fe, be),!gone,app")));
        assert!(!yes(None, Some("app notin (web)")));
        assert!(!yes(None, Some("app!=web")));
    }
}
