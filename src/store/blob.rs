//! Response headers as one byte string, the form the SQLite and Redis stores keep them in (PostgreSQL
//! keeps them in array columns). Pure functions, used by those two stores only.

/// Headers as one blob: for each, the name's and the value's length (4 bytes, big-endian) and bytes.
pub(crate) fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let size = headers
        .iter()
        .map(|(name, value)| 8 + name.len() + value.len())
        .sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in headers {
        for field in [name.as_bytes(), value.as_slice()] {
            out.extend_from_slice(&(field.len() as u32).to_be_bytes());
            out.extend_from_slice(field);
        }
    }
    out
}

/// The inverse of [`encode_headers`]; `None` if the blob is not in that form.
pub(crate) fn decode_headers(mut blob: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let mut headers = Vec::new();
    while !blob.is_empty() {
        let name = take_field(&mut blob)?;
        let value = take_field(&mut blob)?;
        headers.push((String::from_utf8(name.to_vec()).ok()?, value.to_vec()));
    }
    Some(headers)
}

fn take_field<'a>(blob: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, rest) = blob.split_first_chunk::<4>()?;
    let len = u32::from_be_bytes(*len) as usize;
    let (field, rest) = rest.split_at_checked(len)?;
    *blob = rest;
    Some(field)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_including_empty_and_binary_values() {
        let headers = vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            ("x-empty".to_owned(), Vec::new()),
            ("x-binary".to_owned(), vec![0, 0xff, b'\n']),
        ];
        assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
        assert_eq!(decode_headers(&[]), Some(vec![]));
    }

    #[test]
    fn truncated_header_blobs_are_refused() {
        let blob = encode_headers(&[("a".to_owned(), b"bc".to_vec())]);
        for cut in 1..blob.len() {
            assert_eq!(decode_headers(&blob[..cut]), None, "cut at {cut}");
        }
    }
}
